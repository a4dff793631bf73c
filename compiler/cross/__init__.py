"""Kernels for CPUs other than this machine's: aarch64 and RISC-V, by name (`cpus`), built with a
cross toolchain and run under qemu-user (`toolchain`, `emulate`, the C harness `harness.c`)."""
