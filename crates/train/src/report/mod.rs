//! What a run writes for people to read: TensorBoard event files ([`events`]), PNG charts of
//! the metrics log ([`charts`]), and detections drawn on images ([`draw`]).

pub mod charts;
pub mod draw;
pub mod events;
