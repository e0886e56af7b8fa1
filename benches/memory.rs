//! Memory: bytes of controller state per configured identity, measured with a counting global
//! allocator (live heap bytes before and after building a controller with 10,000 identities).
//! Prints a table; `cargo bench --bench memory`.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};

use unyolo_admission::config::{Config, Identity};
use unyolo_admission::{Controller, ManualClock};

struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY: defers every call to the system allocator; only counts the bytes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: same layout, passed through.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: ptr came from System.alloc with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as i64 - layout.size() as i64, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> i64 {
    LIVE.load(Ordering::Relaxed)
}

fn identities(n: usize) -> Vec<Identity> {
    // 10-byte names, a typical service-account length.
    (0..n)
        .map(|i| Identity::new(&format!("bot-{i:06}")).expect("valid"))
        .collect()
}

/// (bytes of the Config alone, bytes the controller adds) for `n` identities.
fn measure(n: usize) -> (i64, i64) {
    let base = live();
    let config = Config::defaults(identities(n));
    let with_config = live();
    let controller = Controller::builder(config)
        .clock(ManualClock::new())
        .build();
    let with_controller = live();
    // Traffic must not grow it: admit and finish once per identity.
    for i in 0..n {
        let name = format!("bot-{i:06}");
        let op = controller.admit(&name, false).expect("admitted").commit();
        op.try_start().expect("started");
        op.succeed().expect("succeeded");
    }
    let after_traffic = live();
    assert_eq!(
        after_traffic, with_controller,
        "traffic grew the controller"
    );
    drop(controller);
    (with_config - base, with_controller - with_config)
}

fn main() {
    // Criterion passes `--bench`; this binary takes no options.
    println!(
        "| identities | config bytes | controller bytes | controller bytes/identity | total bytes/identity |"
    );
    println!("|---:|---:|---:|---:|---:|");
    let (_, empty) = measure(0);
    for n in [1_000, 10_000] {
        let (config, controller) = measure(n);
        println!(
            "| {n} | {config} | {controller} | {:.1} | {:.1} |",
            (controller - empty) as f64 / n as f64,
            (config + controller - empty) as f64 / n as f64,
        );
    }
    println!("(controller with no identities: {empty} bytes)");
}
