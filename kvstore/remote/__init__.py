"""The remote tier: a store shared by the daemons of many hosts, below NVMe.

Modules: `base` (the adapter interface and its contract, the task machinery),
`envelope` (remote object names and the checked trailer after each object), `policy` (which objects
are written: all | none | cost:SECONDS), `tier` (the Store's side: background writes,
verified fills of local misses, counters), `mooncake` (Mooncake Store, the first
adapter), `memory` (an in-process store for tests), `faulty` (fault injection),
`testing` (a real `mooncake_master` on loopback for tests and benchmarks).
Design notes: docs/remote.md.
"""
