"""The model: the exception tree (errors), the units people write (units), and what one
checkpoint is (checkpointmeta). Imports nothing that touches the system."""
