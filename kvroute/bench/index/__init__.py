"""``kvroute bench index``: the prefix index's longest-prefix lookup at fleet scale (``cli``).
``fleet``: the populated index; ``lookups``: the timed lookups."""
