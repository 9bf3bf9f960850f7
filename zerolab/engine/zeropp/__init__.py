"""ZeRO++ (chapter 9): ZeRO-3 with less traffic across nodes.

    engine.py    ``ZeroPPEngine``: qwZ (int8 weight gathers), hpZ (a secondary partition inside the node),
                 qgZ (the gradient reduce-scatter as a two-level int4 all-to-all)
    quantize.py  the block int8/int4 quantization kernel the three share with the book's demos
"""
