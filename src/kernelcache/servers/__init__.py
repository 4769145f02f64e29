"""LLM servers' JIT builds through kernelcache (issue 37): DeepGEMM's compiler shim and vLLM's plugin.

FlashInfer (``FLASHINFER_NVCC_LAUNCHER``), DeepGEMM (``DG_JIT_NVCC_COMPILER``) and
torch's JIT extensions (``PYTORCH_NVCC``) each let a user put a launcher in front of
nvcc; :mod:`kernelcache.servers.shim` makes the one DeepGEMM needs (an executable
file), :mod:`kernelcache.vllm` sets them all in every vLLM process.
"""
