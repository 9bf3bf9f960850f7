"""Mutants of context parallelism beside tensor and pipeline parallelism, trained and checkpointed
(tests/test_mesh_cp_checkpoint.py): the gradient group, the shard a dp×cp rank writes, who gets the whole state
(rank0_only), the mesh manifest's cp, the pipeline's refusal."""
from __future__ import annotations

from mutants import Mutant

T = "tests/test_mesh_cp_checkpoint.py::"
TRAINS = T + "test_tp_cp_trains_like_single_process"
FULL = T + "test_full_state_dict_is_the_single_process_model"
RESUME = T + "test_resume_on_the_same_mesh_equals_the_uninterrupted_run"
RELOAD = T + "test_reload_on_other_meshes_continues_the_same"
REFUSED = T + "test_pipeline_with_context_parallelism_is_refused_by_name"

MUTANTS = [
    Mutant("cpckpt-grads-over-dp-only", "zerolab/runtime/mesh.py",
           'return "dp_cp" if self.cp > 1 else "dp"',
           'return "dp"',
           (TRAINS,), "with cp > 1 the engine's gradient group is dp alone: the cp ranks' gradients are never "
                      "averaged (tp 2 x cp 2: each cp rank trains on its own chunk)"),
    Mutant("cpckpt-shard-named-by-dp-coordinate", "zerolab/engine/checkpoint/save.py",
           "r, stage, flat = engine.rank, engine.stage, engine.flat",
           "r, stage, flat = (engine.mesh.dp_rank if getattr(engine, 'mesh', None) else engine.rank), engine.stage, "
           "engine.flat",
           (RESUME,), "a rank writes the shard of its DP coordinate, not of its dp×cp rank: both cp ranks save "
                      "shard 0, and shard 1 is missing"),
    Mutant("cpckpt-rank0-only-by-dp-coordinate", "zerolab/engine/checkpoint/mesh_state.py",
           "return None if rank0_only and mesh.rank != 0 else sd",
           "return None if rank0_only and mesh.dp_rank != 0 else sd",
           (FULL,), "full_state_dict(rank0_only=True) answers on every rank of DP coordinate 0: with cp > 1 (and "
                    "tp > 1) ranks other than global rank 0 get the whole model too"),
    Mutant("cpckpt-manifest-forgets-cp", "zerolab/engine/checkpoint/mesh.py",
           '**({"cp": m["cp"]} if m["cp"] > 1 else {})',
           "**{}",
           (RELOAD,), "mesh.json records dp 1, tp 2, pp 1 for a save by 4 ranks: the cp axis is lost"),
    Mutant("cpckpt-folder-by-cp-coordinate", "zerolab/engine/checkpoint/mesh_state.py",
           '"tp_rank": mesh.tp_rank,',
           '"tp_rank": mesh.cp_rank,',
           (RELOAD,), "a mesh checkpoint's folder and TP cut follow the cp coordinate, not the TP one"),
    Mutant("cpckpt-pipeline-accepts-cp", "zerolab/parallel/pipeline.py",
           'if p > 1 and getattr(mesh, "cp", 1) > 1:',
           "if False:",
           (REFUSED,), "pp 2 x cp 2 accepted: the first micro-batch dies in a bare NotImplementedError (a stage "
                       "calls the model's ModuleDict blocks) instead of a refusal naming pp and cp"),
]
