"""Reading adapters: what an adapter file declares, in whichever format, checked
against the base and made into slot rows.

    formats/      mlx-lm, PEFT (dense and experts) and llama.cpp GGUF files -> LoRAWeights
    weights.py    LoRAWeights / ModuleLoRA, the checks against the base, stacking (stack_weights)
    dora.py       DoRA's magnitudes as the formats store them, and what is refused of DoRA
    recipe.py     SlotRecipe: the adapter files and scales a slot holds, and how it is read
    loader.py     AdapterLoader: reads on a reader thread into PreparedAdapter; SlotPort

It sits on mola.lora (the packs' geometry and rows) and below mola.registry.
"""
