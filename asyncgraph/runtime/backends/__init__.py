"""The event-loop backends behind runtime/backend.py's seam: asyncio (uvloop included) and trio.

`base.py` holds the protocols both implement; runtime/backend.py picks one per running loop
and is the only module of the runtime that imports them (trio's only while a trio run is on).
"""
