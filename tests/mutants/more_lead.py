"""Mutants of the lead's own fixes this round."""
from mutants import Mutant

MUTANTS = [
    Mutant("load-keeps-file-pages", "zerolab/engine/bigmodel/load.py",
           "        release_pages(opened)   # this unit's file pages leave the rank's resident set",
           "        pass",
           ("tests/test_load_mapped_pages.py::test_load_resident_peak_is_a_unit_or_two_of_file_pages",),
           "loading keeps every mapped page resident: a rank reading half of each tensor holds the whole file"),
]
MUTANTS.append(
    Mutant("tp1-state-in-linear-layout", "zerolab/engine/api.py",
           "        return original_layout(self.module, consolidated_state_dict(self, rank0_only))",
           "        return consolidated_state_dict(self, rank0_only)",
           ("tests/test_mesh_checkpoint.py::test_hf_gpt2_fused_qkv_reshards_tp2_to_tp1_and_back",),
           "at tp 1 full_state_dict returns a converted GPT-2 Conv1D weight in the Linear layout (out x in)"))
MUTANTS.append(
    Mutant("zero-init-hf-device-meta", "zerolab/engine/bigmodel/zero_init.py",
           "        module._kernels_device = pieces[0].device.type",
           "        pass",
           ("tests/test_zero_init.py::test_zero_init_from_pretrained_kernelizes_for_the_device_the_pieces_are_on",),
           "a Hugging Face model built under zero.Init reports the meta device: transformers refuses to kernelize"))
