"""Everything about adapters: the multi-LoRA layer, slot packs, file formats and
the registry that maps model ids to slots."""
