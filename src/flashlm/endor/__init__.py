"""flashlm.endor: Endor's bitmap sparse format for pruned weights, Wanda pruning, and the Endor store."""
