//! Tokenizer, chat template and output parsing (being written).
