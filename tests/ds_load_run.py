"""DeepSpeed's ``load_checkpoint`` on a folder, as a DeepSpeed user would call it (tests/test_ds_checkpoint_layout.py).

    DS_ACCELERATOR=cpu python tests/ds_load_run.py CKPT_DIR STAGE OUT.json

One CPU rank (gloo) builds tests/ds_resume_run.py's engine (the fixture model, DeepSpeed's own FusedAdam)
at ZeRO stage STAGE, calls ``engine.load_checkpoint(CKPT_DIR)`` and writes what happened to OUT.json:
``{"returned": [path, client_state keys]}`` or ``{"error": type, "message": text}``.
"""
from __future__ import annotations

import importlib
import json
import os
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ds_resume_run as run  # noqa: E402


def main(argv):
    ckpt, stage, out = argv[0], int(argv[1]), Path(argv[2])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    importlib.import_module("deepspeed.comm.torch")   # skip the JIT build of an inference-only op
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda *a, **kw: None
    import deepspeed
    from zerolab.runtime.group_exit import close_at_exit
    deepspeed.init_distributed(dist_backend="gloo")
    close_at_exit()
    engine = run._engine(deepspeed, stage, "fp32", 0)
    try:
        path, client = engine.load_checkpoint(ckpt)
        result = {"returned": [path, sorted(client or {})]}
    except Exception as e:  # noqa: BLE001 - what DeepSpeed raised is the result
        result = {"error": type(e).__name__, "message": str(e)[:2000]}
    out.write_text(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1:])
