"""Content hashes: sha256 of objects, xxh3-128 and mixsum-128 of tensors, the state hash,
and the registry that says which applies."""
