"""The paged KV cache's bookkeeping on its own: admit a sequence and get its block table.

The founding article's second snippet, with only the import changed. No model and no tensors:
blocks are integer ids, and the block manager only decides which ones a sequence holds.

    python examples/block_manager.py
"""

from asyncengine.core.block_manager import BlockSpaceManager

block_manager = BlockSpaceManager(
    block_size=512,
    num_gpu_blocks=1024,
    num_cpu_blocks=128,
    sliding_window=None,
)

seq_len = 2000  # tokens of the prompt
blocks_needed = (seq_len + block_manager.block_size - 1) // block_manager.block_size

if block_manager.can_allocate(blocks_needed):
    block_table = block_manager.allocate(seq_len)
    print(f"{seq_len} tokens -> {len(block_table)} blocks: {list(block_table)}")
    print(f"free GPU blocks: {block_manager.get_num_free_gpu_blocks()} of 1024")

    block_manager.free(block_table)
    print(f"after free: {block_manager.get_num_free_gpu_blocks()} of 1024")

# a sequence larger than the whole cache can never be admitted
too_big = 1025
print(f"can_allocate({too_big} blocks): {block_manager.can_allocate(too_big)}")
