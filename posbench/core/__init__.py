"""The shared leaves every layer imports: errors, io, the registries' base, the Hydra
resolvers and composition, the version, the device, progress bars, parity and plots. Imports
nothing of posbench above it; this file imports nothing."""
