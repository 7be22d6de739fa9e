"""nn.Modules and checkpoint readers/writers for drafters."""
