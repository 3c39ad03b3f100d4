"""``kvroute bench gpu-check``: kvroute's GPU paths against raw torch (``cli``). ``copies``:
the paged cache's gather, scatter and copies on one device; ``links``: the torch.distributed
link between two processes. Both import torch; ``cli`` only when it runs."""
