"""Membership registries: the interface (base.py), its stores (bootstrap.py, etcd.py), the
record every store validates (records.py), the loops that use them (membership.py, watcher.py) and the
`--registry` settings (config.py)."""
