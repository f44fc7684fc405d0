//! The OpenAI-compatible HTTP server and Prometheus registry of sluice.
//!
//! Not built yet: it arrives with the server issue (engine thread behind channels, `/v1/chat/completions`,
//! `/v1/completions`, `/metrics`). The crate exists now so the workspace has its final shape
//! (`tools → server → runtime → expert-store`); it deliberately exports nothing.
