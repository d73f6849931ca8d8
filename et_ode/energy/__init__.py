"""The energy: the LayerNorm neuron, energy attention, Hopfield memories, masks, the ET block, the checks of its inputs."""
