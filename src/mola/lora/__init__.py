"""The device math of multi-LoRA: the layers that add every row's adapter delta
in one batch, and the slot packs across a model.

    routing.py    LoRARouting: which slot each row of a forward pass uses
    geometry.py   which linears carry LoRA, their dims and sharding, a slot's rows
    layer.py      MultiLoRALinear: a base linear plus slot-indexed LoRA packs
    experts.py    its twin on the experts of a mixture of experts (SwitchGLU)
    dora.py       DoRA's per-slot magnitude scale g [S, out], applied per row
    pack.py       AdapterPacks: every such layer of a model, its packs sized to what is loaded
    slot_rows.py  SlotGeometry (what a slot takes, what packs weigh), SlotRows, PackStats

It imports nothing from mola's other packages: reading adapters is
mola.adapters, who holds which slot is mola.registry.
"""
