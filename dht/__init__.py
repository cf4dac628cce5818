"""dht package."""
