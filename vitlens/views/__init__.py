"""The four views of the ViT paper (section 4.5, appendix D.7-D.8), each a pure function
returning a result object of numpy arrays."""
