"""The model: the exception tree (errors), the units people write (units), what one
checkpoint is (checkpointmeta, metaschema), and the infrastructure below everything
(atomicfile, wakepipe, runner, quietserve). Imports nothing of oomguard above it."""
