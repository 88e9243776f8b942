"""The ground floor: what every other floor stands on -- PyTorch's versions and builds (``compat``), errors,
files written atomically, limits, numbers read back from the device (``lazy``) and the record formats' versions.
Imports nothing of qkvtrace's other floors."""
