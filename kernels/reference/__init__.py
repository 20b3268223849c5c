"""Plain-torch references: the contract each Triton kernel is tested against."""
