"""obsd's robustness suite: seeded random traffic under injected faults, every recorded
history checked against the contract (../../shared/PROTOCOL.md) afterwards.

An independent implementation on purpose: the Python standard library only, no code shared
with the daemon or its Swift client, so a misreading of the contract that the daemon and its
own tests share is not shared here too. See ../README.md.
"""
