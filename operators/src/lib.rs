//! kvflow's timely operators (admit, schedule, align, forward, emit, …), one per file, and the
//! per-rank state each owns. The runtime issue fills this crate; see DESIGN.md §4.
