"""Building blocks of the decoder: tensor-parallel-shaped linear layers, embeddings, attention."""
