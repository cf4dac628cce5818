"""The public Python API: ``peer.DHT``, ``peer.Optimizer``, ``peer.profile`` (re-exported lazily
by :mod:`peer`). The argument names follow ``hivemind.DHT`` and ``hivemind.Optimizer`` 1.1.12 where
they mean the same thing; docs/API.md maps every one of theirs to ours."""
