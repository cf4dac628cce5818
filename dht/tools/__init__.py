"""Tools around the DHT: ``peer bench dht``, the per-RPC bench, an in-memory network that
simulates thousands of nodes with churn, and fault injection by wrapping a transport.

May import: every room of :mod:`dht` and its front door. Nothing in :mod:`dht` imports this.
"""
