//! The progress bar shown on stderr while large files are processed.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Inputs at least this large (in bytes of tensor data) get a progress bar.
pub const LARGE_INPUT_BYTES: u64 = 64 << 20;

/// A bar counting `total_bytes` of tensor data on stderr, or a hidden one when the input
/// is smaller than [`LARGE_INPUT_BYTES`]. indicatif draws nothing when stderr is not a
/// terminal.
pub fn bar(total_bytes: u64) -> ProgressBar {
    if total_bytes < LARGE_INPUT_BYTES {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(
        "{bar:40} {binary_bytes}/{binary_total_bytes} {elapsed_precise} {wide_msg}",
    )
    .expect("the template is valid");
    ProgressBar::with_draw_target(Some(total_bytes), ProgressDrawTarget::stderr()).with_style(style)
}
