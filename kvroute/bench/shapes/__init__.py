"""``kvroute bench shapes``: which pool shape serves the most goodput at N engines, in the simulator.

* ``systems``: kvroute's candidate shapes and the peers' models, each a simulated run;
* ``goodput``: the SLO judgment of simulated requests and the goodput search over rates;
* ``report``: the verdicts (kvroute's chosen shape over the best peer, where splitting pays);
* ``cli``: the command, its tables and results.json.
"""
