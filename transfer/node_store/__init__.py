"""The node KV tier: a store on each host that keeps KV blocks in host memory (and
optionally on disk) behind every engine cache there, keyed by kvroute's namespaced block
hashes. See docs/transfer.md, "Node KV tier"."""
