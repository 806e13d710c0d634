"""Plans, launchers, validation and device state (Triton kernels: ``fusedqkv.kernels``)."""
