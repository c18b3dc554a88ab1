"""vxc runtime: mmap weight loading, the state provider, prefill/decode sessions, sampling."""
