"""Checkpoints (chapter 8): saving, loading at any world size and stage, consolidating, reading DeepSpeed's.

    save.py         ``engine.save_checkpoint`` / ``save_16bit_model``: every rank writes its shard, atomically
    load.py         ``engine.load_checkpoint``: each rank reads the elements it now owns, whatever the saved layout
    files.py        file names, the manifest, checksummed writes, ``latest``
    state.py        the engine's state unit by unit: what is saved, the full state dict, offload's pieces
    reshard.py      a saved checkpoint as one flat range per unit: any rank's elements, or everything (consolidate)
    consolidate.py  ``python -m zerolab consolidate``: one fp32 state dict, no torch.distributed, no engine
    mesh.py         under a 3D mesh: one plain checkpoint per (tp, pp) coordinate + mesh.json; loaded into any mesh
    mesh_source.py  a mesh checkpoint seen as one plain checkpoint of this rank's parameters, re-sliced along TP
    mesh_state.py   the whole model's state under a mesh: the model's description, full_state_dict over TP/PP/DP
    ds_files.py     DeepSpeed's own checkpoint files, found and unpickled safely
    ds_merge.py     DeepSpeed's fp32 partitions merged into whole weights
    ds_load.py      DeepSpeed's ZeRO files seen as a zerolab checkpoint: what load_checkpoint resumes from
    ds_universal.py DeepSpeed's universal checkpoint (zero/<param>/fp32.pt ...) seen the same way
    ds_save.py      a zerolab checkpoint written as DeepSpeed's ZeRO-1/2/3 files
    ds_engine.py    ``engine.save_checkpoint(..., format="deepspeed")``
    ds_convert.py   ``python -m zerolab convert SRC DST --to deepspeed|zerolab``

The format is docs/CHECKPOINTS.md.
"""
