"""peerd: a per-node daemon that brokers peer-mapped device buffers for TP workers."""

__version__ = "0.1.0"
