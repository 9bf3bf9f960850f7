"""Model parallelism composed with ZeRO (chapter 11): tensor-parallel layers and the plans that
convert a model to them (Megatron-LM's scheme). Imports torch, the runtime (``zl.mesh``'s groups
and their communicators) and the theory; never the engine, the book or the bench: the engine
shards a converted model over the mesh's DP group like any other model.
"""
