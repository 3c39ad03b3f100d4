"""The ground every other package stands on: wire types, identity (namespaces and block
hashes), the config loader, net and process helpers, KV-event types, the model files and
their fingerprint, and the torch-free control client of a transfer endpoint.

It imports no other package of kvroute (``make lint`` checks it)."""
