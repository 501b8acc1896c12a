import os

# Keep UCX on loopback and NIXL quiet, in this process and in every peer process it spawns.
os.environ.setdefault("UCX_NET_DEVICES", "lo")
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
