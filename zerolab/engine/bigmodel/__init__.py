"""Models too large for one rank (chapter 6): built on the meta device, filled unit by unit, loaded shard by shard.

    materialize.py  filling the flat buffers unit by unit: a model's own values, or a meta-device model's
                    ``reset_parameters()``, never the whole model on one rank
    load.py         ``engine.load_state_dict``: a dict, ``.pt`` or ``.safetensors`` (memory-mapped), each
                    rank copying only its shard's elements
"""
