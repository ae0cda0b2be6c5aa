"""`python -m specrpc.native`: build the native decode step now (make install runs it) and say where it is.
`--amx-check`: check the AMX products against VNNI's in this process (`specrpc.native.amx_available` runs it):
exit status 0 where they give the same bits."""
import logging
import sys

import torch

from specrpc.native import build, library

logging.basicConfig(level=logging.INFO)
if sys.argv[1:] == ["--amx-check"]:
    lib = library()
    result = -1 if lib is None else lib.specrpc_amx_check(torch.get_num_threads())
    print({0: "AMX products: the same bits as VNNI's", -1: "AMX products: not available here"}.get(
        result, f"AMX products: differ from VNNI's at {result} tokens"))
    sys.exit(0 if result == 0 else 1)
built = build()
print(f"native decode: {built if built is not None else 'not built (the torch forward serves every step)'}")
