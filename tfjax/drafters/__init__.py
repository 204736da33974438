"""Drafters beside the target: `dflash2` (DFlash and DFlash2 block drafters)."""
