"""Model states off the training device: optimizer states and master weights on the host (``host.py``) or on disk
(``disk.py``), and stage-3 parameter shards on the host or on disk."""
