"""vxc code generation: IR → torch.fx graphs calling ``torch.ops.vxc.*`` kernels."""
