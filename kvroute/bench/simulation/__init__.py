"""Measurements in the simulator (``simulator``): ``kvroute bench simulate`` (``simulate``),
``kvroute bench simulate-scale`` (``scale``) and ``kvroute bench validate-simulator``
(``validate``, against a real run that ``real_run`` reads back)."""
