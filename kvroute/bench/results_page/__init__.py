"""``kvroute bench results-page``: the results page (``cli``). ``setup``: what every run
shares; ``runs``: the simulated part and the real-cluster validations; ``plots``; ``page``,
``real_sections`` and ``text``: the Markdown."""
