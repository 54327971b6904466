"""Expert parallel MoE layers and their load-balancing loss."""
