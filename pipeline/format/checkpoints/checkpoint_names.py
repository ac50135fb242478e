"""What a trainer publishes from a model in memory: the names and layout of its checkpoint.

transformers 5 holds some weights in memory in another form than its checkpoints:
Mixture-of-Experts layers keep their experts fused (``mlp.experts.gate_up_proj``, one
tensor per layer), while ``save_pretrained`` writes one tensor per expert
(``mlp.experts.0.gate_proj.weight``), the format inference engines load. A state dict
taken from the live model is therefore not a checkpoint. ``checkpoint_state`` runs
transformers' own conversion, the one ``save_pretrained`` runs (tied copies dropped,
in-memory renames and fusions reverted), so no table per architecture is kept here.

The form published is recorded in the staging checkpoint's safetensors metadata
(``FORM_METADATA_KEY``) and from there in the version's manifest (``tensor_form``):

- ``"checkpoint"``: converted by transformers to what ``save_pretrained`` writes
  (identical to the state dict where the model keeps nothing fused);
- ``"state_dict"``: a module's own ``state_dict``, for a module that is no transformers
  model (no known checkpoint format);
- ``"given"``: the tensors as the caller passed them, unchanged.

transformers is imported only when the module is an instance of it (it is then loaded).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Literal

import torch

from pipeline.format.checkpoints.checkpoint import CheckpointReader

TensorForm = Literal["checkpoint", "state_dict", "given"]
TENSOR_FORMS: tuple[TensorForm, ...] = ("checkpoint", "state_dict", "given")
FORM_METADATA_KEY = "deltasync.tensor_form"


def is_transformers_model(module: torch.nn.Module) -> bool:
    transformers = sys.modules.get("transformers")  # a model of it means it is imported
    base = getattr(transformers, "PreTrainedModel", None) if transformers is not None else None
    return isinstance(base, type) and isinstance(module, base)


def checkpoint_state(module: torch.nn.Module) -> tuple[Mapping[str, torch.Tensor], TensorForm]:
    """The tensors to publish for ``module`` and their form (see module doc)."""
    state = module.state_dict()
    if not is_transformers_model(module):
        return state, "state_dict"
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model: Any = module  # a PreTrainedModel (checked above)
    # The order save_pretrained uses: drop tied aliases (by storage), then revert.
    state = remove_tied_weights_from_state_dict(state, model)
    converted: Mapping[str, torch.Tensor] = revert_weight_conversion(model, state)
    return converted, "checkpoint"


def converts_weights(module: torch.nn.Module) -> bool:
    """Whether transformers' checkpoint conversion of a transformers model derives new
    tensors (fused experts split, say) rather than only renaming and dropping tied
    copies."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    model: Any = module
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:
        conversions = get_model_conversion_mapping(model, add_legacy=False)
    return any(isinstance(c, WeightConverter) for c in conversions or ())


def checkpoint_renaming(module: torch.nn.Module, names: list[str]) -> dict[str, str] | None:
    """For a transformers model whose state dict has ``names``: checkpoint name -> state
    dict name of each tensor ``save_pretrained`` writes; None when the conversion derives
    new tensors (``converts_weights``).

    Worked out on stand-ins, one small tensor per parameter or buffer (tied names
    sharing one), so no weight is touched: for sharded weights (DTensors) a weight's
    storage says nothing about ties, and reshaping one may need a collective."""
    if converts_weights(module):
        return None
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    model: Any = module
    owners: dict[str, object] = dict(module.named_buffers(remove_duplicate=False))
    owners.update(module.named_parameters(remove_duplicate=False))
    standins: dict[int, torch.Tensor] = {}
    proxy: dict[str, torch.Tensor] = {}
    for name in names:
        owner = owners.get(name, name)  # no module attribute: a tensor of its own
        proxy[name] = standins.setdefault(id(owner), torch.zeros(1))
    kept = remove_tied_weights_from_state_dict(dict(proxy), model)
    back = {id(t): name for name, t in kept.items()}
    out: dict[str, str] = {}
    for new, tensor in revert_weight_conversion(model, kept).items():
        old = back.get(id(tensor))
        if old is None:  # a tensor derived after all, not a renamed one
            return None
        out[new] = old
    return out


def published_form(reader: CheckpointReader) -> TensorForm | None:
    """The form recorded in a staging checkpoint's metadata; None when not recorded
    (a checkpoint the user wrote)."""
    value = reader.metadata.get(FORM_METADATA_KEY)
    for form in TENSOR_FORMS:
        if value == form:
            return form
    return None
