"""`python -m specrpc.native`: build the native decode step now (make install runs it) and say where it is."""
import logging

from specrpc.native import build

logging.basicConfig(level=logging.INFO)
built = build()
print(f"native decode: {built if built is not None else 'not built (the torch forward serves every step)'}")
