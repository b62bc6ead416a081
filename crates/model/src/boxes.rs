//! Axis-aligned boxes in `[ymin, xmin, ymax, xmax]` order, as the TF Object Detection API keeps them.

use serde::{Deserialize, Serialize};

/// A box given by its corners, `ymin, xmin, ymax, xmax` (normalised or pixel coordinates).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize, Default)]
pub struct BBox {
    /// Top edge.
    pub ymin: f32,
    /// Left edge.
    pub xmin: f32,
    /// Bottom edge.
    pub ymax: f32,
    /// Right edge.
    pub xmax: f32,
}

impl BBox {
    /// A box from its corners.
    pub const fn new(ymin: f32, xmin: f32, ymax: f32, xmax: f32) -> Self {
        Self {
            ymin,
            xmin,
            ymax,
            xmax,
        }
    }

    /// The corners as `[ymin, xmin, ymax, xmax]`.
    pub fn to_array(self) -> [f32; 4] {
        [self.ymin, self.xmin, self.ymax, self.xmax]
    }

    /// Height (may be negative for a malformed box).
    pub fn height(&self) -> f32 {
        self.ymax - self.ymin
    }

    /// Width (may be negative for a malformed box).
    pub fn width(&self) -> f32 {
        self.xmax - self.xmin
    }

    /// Area, as the API computes it: `height * width` without clamping.
    pub fn area(&self) -> f32 {
        self.height() * self.width()
    }

    /// Centre and size: `(ycenter, xcenter, height, width)`.
    pub fn center_size(&self) -> (f32, f32, f32, f32) {
        let h = self.height();
        let w = self.width();
        (self.ymin + h / 2.0, self.xmin + w / 2.0, h, w)
    }

    /// Area of the overlap with `other` (zero when they do not overlap).
    pub fn intersection(&self, other: &BBox) -> f32 {
        let h = (self.ymax.min(other.ymax) - self.ymin.max(other.ymin)).max(0.0);
        let w = (self.xmax.min(other.xmax) - self.xmin.max(other.xmin)).max(0.0);
        h * w
    }

    /// Intersection over union; zero when the intersection is zero (the API's convention).
    pub fn iou(&self, other: &BBox) -> f32 {
        let inter = self.intersection(other);
        if inter == 0.0 {
            return 0.0;
        }
        inter / (self.area() + other.area() - inter)
    }

    /// This box clipped to `window`.
    pub fn clip_to(&self, window: &BBox) -> BBox {
        BBox::new(
            self.ymin.clamp(window.ymin, window.ymax),
            self.xmin.clamp(window.xmin, window.xmax),
            self.ymax.clamp(window.ymin, window.ymax),
            self.xmax.clamp(window.xmin, window.xmax),
        )
    }

    /// This box scaled from normalised to pixel coordinates of a `height` x `width` image.
    pub fn to_pixels(&self, height: u32, width: u32) -> BBox {
        let (h, w) = (height as f32, width as f32);
        BBox::new(self.ymin * h, self.xmin * w, self.ymax * h, self.xmax * w)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn iou_of_half_overlapping_boxes() {
        let a = BBox::new(0.0, 0.0, 1.0, 1.0);
        let b = BBox::new(0.0, 0.5, 1.0, 1.5);
        // intersection 0.5, union 1.5
        assert!((a.iou(&b) - 1.0 / 3.0).abs() < 1e-6);
        assert_eq!(a.iou(&BBox::new(2.0, 2.0, 3.0, 3.0)), 0.0);
        assert_eq!(a.iou(&a), 1.0);
    }

    #[test]
    fn clip_and_pixels() {
        let b = BBox::new(-0.2, 0.5, 1.3, 0.9).clip_to(&BBox::new(0.0, 0.0, 1.0, 1.0));
        assert_eq!(b, BBox::new(0.0, 0.5, 1.0, 0.9));
        assert_eq!(b.to_pixels(200, 100), BBox::new(0.0, 50.0, 200.0, 90.0));
    }
}
