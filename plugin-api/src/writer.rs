//! The host's side of [`FfiActionWriter`]: the one engine-format message of a
//! booking (rule R10), written as the policies call in, into a buffer the host
//! owns and reuses from booking to booking.
//!
//! Why the host writes the JSON: a payload a plugin wrote as text would have to
//! be parsed again before it could be trusted, or trusted blindly. Here the
//! plugin hands over values one call at a time and this writer emits every
//! byte itself, checking the grammar as it goes (keys only in objects, one
//! value per key, containers closed, the payload an object, floats finite), so
//! the finished message is valid JSON by construction.
//!
//! Rules applied here, in call order:
//! - R7: actions are numbered `a1`, `a2`, …; past `max_actions` whole actions
//!   are dropped (and counted), which drops the later policies' first.
//! - R8: [`MessageWriter::end_policy`] with a failure, or after the policy broke
//!   the grammar, rolls the buffer back to where that policy began: it loses
//!   its own actions and nothing else.
//!
//! - Engine hashes go out as their engine published them: SGLang publishes
//!   signed 64-bit hashes, which policies see as `u64` (the same bits). The host
//!   records the hash slices it lent the policies from such engines
//!   ([`SignedHashes`]), and [`MessageWriter::u64_array`] writes an array it gets
//!   back from one of them as signed integers. No ABI change and no action type
//!   or payload field known to the host: a policy passes on the slice (or part of
//!   it) it was given, as `kv_fetch` does, and it is written as its source
//!   published it. A copy the policy made itself is its own and goes out unsigned.
//!
//! The router links this in; plugin-api's `testing` module uses it too, so a
//! plugin's unit tests see exactly the message the router would send.

use crate::abi::{FfiActionWriter, FfiWriterVtable};
use abi_stable::marker_type::ErasedObject;
use abi_stable::std_types::{RSlice, RStr};
use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::rc::Rc;

/// The envelope's `protocol_version`.
pub const PROTOCOL_VERSION: &str = "0.1";

/// Containers deeper than this are refused: a payload is a flat record, and the
/// bound keeps a runaway policy from growing the stack.
pub const MAX_DEPTH: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Frame {
    /// In an object; `expect_key` until a key is written, then a value.
    Object {
        first: bool,
        expect_key: bool,
    },
    Array {
        first: bool,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Between actions.
    Idle,
    /// After `begin_action`, before the payload's top-level object.
    Payload,
    /// Inside the payload (the stack is not empty).
    Writing,
    /// The payload's object is closed; only `end_action` may follow.
    Closed,
    /// An action past the cap: everything until `end_action` is ignored.
    Dropping,
}

/// Where a policy began, to roll back to.
#[derive(Debug, Clone, Copy)]
struct Mark {
    len: usize,
    actions: usize,
    dropped: usize,
    types_len: usize,
    type_ends: usize,
}

/// One booking's message being written.
#[derive(Debug)]
pub struct MessageWriter {
    out: Vec<u8>,
    stack: Vec<Frame>,
    phase: Phase,
    /// Where the current action began in `out` (to drop it if it breaks).
    action_start: usize,
    actions: usize,
    max_actions: usize,
    dropped: usize,
    /// The action types in order, concatenated, with their ends.
    types: String,
    type_ends: Vec<usize>,
    /// The current policy's first grammar error.
    error: Option<String>,
    mark: Mark,
    /// Bytes the envelope's head takes (a message with no action is none).
    head_len: usize,
    /// The booking's lent slices of signed engine hashes, if the host set them.
    signed: Option<Rc<SignedHashes>>,
}

/// The slices of engine hashes a host lent one booking's policies whose engines
/// publish signed 64-bit hashes (SGLang's), by address: an array written from
/// within one of them goes out signed. Single-threaded, as a booking is.
#[derive(Debug, Default)]
pub struct SignedHashes {
    /// `[start, end)` addresses of each lent slice.
    ranges: RefCell<Vec<(usize, usize)>>,
}

impl SignedHashes {
    /// Forgets every slice (a new booking).
    pub fn clear(&self) {
        self.ranges.borrow_mut().clear();
    }

    /// Records `hashes`, lent to a policy, as published signed. The host must keep
    /// them where they are until [`Self::clear`]: an address is all that is kept.
    pub fn lend(&self, hashes: &[u64]) {
        if !hashes.is_empty() {
            let range = hashes.as_ptr_range();
            self.ranges
                .borrow_mut()
                .push((range.start as usize, range.end as usize));
        }
    }

    /// Whether `values` lies wholly within a slice lent as signed.
    pub fn covers(&self, values: &[u64]) -> bool {
        let range = values.as_ptr_range();
        let (start, end) = (range.start as usize, range.end as usize);
        self.ranges
            .borrow()
            .iter()
            .any(|&(from, to)| from <= start && end <= to)
    }
}

impl Default for MessageWriter {
    fn default() -> Self {
        Self {
            out: Vec::new(),
            stack: Vec::new(),
            phase: Phase::Idle,
            action_start: 0,
            actions: 0,
            max_actions: 32,
            dropped: 0,
            types: String::new(),
            type_ends: Vec::new(),
            error: None,
            mark: Mark {
                len: 0,
                actions: 0,
                dropped: 0,
                types_len: 0,
                type_ends: 0,
            },
            head_len: 0,
            signed: None,
        }
    }
}

/// Why a policy's actions were discarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PolicyOutput {
    /// It kept this many actions in the message.
    Kept(usize),
    /// It broke the writer's grammar (the message says how).
    Malformed(String),
}

impl MessageWriter {
    /// Starts a message for `message_id` with room for `max_actions` actions,
    /// reusing the buffers of the last one.
    /// Where this message's signed engine hashes are recorded (`None`: there are
    /// none); kept until set again.
    pub fn set_signed_hashes(&mut self, signed: Option<Rc<SignedHashes>>) {
        self.signed = signed;
    }

    pub fn begin_message(&mut self, message_id: &str, max_actions: usize) {
        self.out.clear();
        self.stack.clear();
        self.types.clear();
        self.type_ends.clear();
        self.phase = Phase::Idle;
        self.actions = 0;
        self.dropped = 0;
        self.error = None;
        self.max_actions = max_actions;
        self.out.extend_from_slice(b"{\"protocol_version\":");
        write_string(&mut self.out, PROTOCOL_VERSION);
        self.out.extend_from_slice(b",\"message_id\":");
        write_string(&mut self.out, message_id);
        self.out.extend_from_slice(b",\"actions\":[");
        self.head_len = self.out.len();
        self.mark = self.mark_now();
    }

    fn mark_now(&self) -> Mark {
        Mark {
            len: self.out.len(),
            actions: self.actions,
            dropped: self.dropped,
            types_len: self.types.len(),
            type_ends: self.type_ends.len(),
        }
    }

    /// Marks where the next policy's actions begin.
    pub fn begin_policy(&mut self) {
        self.stack.clear();
        self.phase = Phase::Idle;
        self.error = None;
        self.mark = self.mark_now();
    }

    /// Ends a policy's turn. `ok` is false when the policy itself failed; then,
    /// or when it broke the grammar or left an action open, everything it wrote
    /// is rolled back.
    pub fn end_policy(&mut self, ok: bool) -> PolicyOutput {
        if self.error.is_none() && self.phase != Phase::Idle {
            self.error = Some("the policy returned with an action still open".into());
        }
        let error = self.error.take();
        if ok && error.is_none() {
            return PolicyOutput::Kept(self.actions - self.mark.actions);
        }
        self.rollback();
        match error {
            Some(message) => PolicyOutput::Malformed(message),
            None => PolicyOutput::Kept(0),
        }
    }

    fn rollback(&mut self) {
        let mark = self.mark;
        self.out.truncate(mark.len);
        self.actions = mark.actions;
        self.dropped = mark.dropped;
        self.types.truncate(mark.types_len);
        self.type_ends.truncate(mark.type_ends);
        self.stack.clear();
        self.phase = Phase::Idle;
    }

    /// Actions in the message so far.
    pub fn actions(&self) -> usize {
        self.actions
    }

    /// Actions dropped over the cap so far (rule R7).
    pub fn dropped(&self) -> usize {
        self.dropped
    }

    /// The message's action types, in order.
    pub fn action_types(&self) -> impl Iterator<Item = &str> {
        let mut start = 0;
        self.type_ends.iter().map(move |&end| {
            let text = &self.types[start..end];
            start = end;
            text
        })
    }

    /// Closes the message: its text, or `None` if no action is in it. Valid
    /// JSON by construction (see the module docs).
    pub fn finish(&mut self) -> Option<&str> {
        if self.actions == 0 {
            return None;
        }
        self.out.extend_from_slice(b"]}");
        // SAFETY: every byte came from `write_string` (serde_json's escaping of
        // a `&str`, itself UTF-8), ASCII punctuation or ASCII digits, so the
        // buffer is UTF-8 throughout; checking it again would cost a pass over
        // every byte of every booking's message.
        Some(unsafe { std::str::from_utf8_unchecked(&self.out) })
    }

    /// An [`FfiActionWriter`] over this writer, to pass to a policy. The
    /// pointer stays valid while `self` is borrowed.
    pub fn ffi(&mut self) -> FfiActionWriter {
        FfiActionWriter {
            state: (self as *mut Self).cast::<ErasedObject>(),
            vtable: &VTABLE,
        }
    }

    fn fail(&mut self, message: impl Into<String>) {
        if self.error.is_none() {
            self.error = Some(message.into());
        }
        // Nothing more of this policy is written; its actions will be rolled back.
        if self.phase != Phase::Dropping {
            self.phase = Phase::Dropping;
        }
    }

    fn failed(&self) -> bool {
        self.error.is_some()
    }

    pub fn begin_action(&mut self, action_type: &str, action_version: &str) {
        if self.failed() {
            return;
        }
        if self.phase != Phase::Idle {
            return self.fail("an action was begun inside another action");
        }
        if action_type.is_empty() {
            return self.fail("an action has an empty action_type");
        }
        if action_version.is_empty() {
            return self.fail(format!(
                "action {action_type:?} has an empty action_version"
            ));
        }
        if self.actions == self.max_actions {
            self.dropped += 1;
            self.phase = Phase::Dropping;
            return;
        }
        self.action_start = self.out.len();
        if self.out.len() > self.head_len {
            self.out.push(b',');
        }
        let id = self.actions + 1;
        self.out.extend_from_slice(b"{\"action_id\":\"a");
        let mut digits = itoa::Buffer::new();
        self.out.extend_from_slice(digits.format(id).as_bytes());
        self.out.extend_from_slice(b"\",\"action_type\":");
        write_string(&mut self.out, action_type);
        self.out.extend_from_slice(b",\"action_version\":");
        write_string(&mut self.out, action_version);
        self.out.extend_from_slice(b",\"payload\":");
        self.types.push_str(action_type);
        self.type_ends.push(self.types.len());
        self.phase = Phase::Payload;
    }

    pub fn end_action(&mut self) {
        match self.phase {
            Phase::Dropping if !self.failed() => self.phase = Phase::Idle,
            Phase::Dropping => {}
            Phase::Closed => {
                self.out.push(b'}');
                self.actions += 1;
                self.phase = Phase::Idle;
            }
            Phase::Idle => self.fail("end_action without begin_action"),
            Phase::Payload => self.fail("an action ended without a payload"),
            Phase::Writing => self.fail("an action ended inside its payload (a container is open)"),
        }
    }

    /// Before any value: the separator, the grammar, and whether to write it.
    fn before_value(&mut self, what: &str) -> bool {
        self.before(what, false)
    }

    /// [`Self::before_value`]; `object` when the value is an object (the only
    /// value a payload may be).
    fn before(&mut self, what: &str, object: bool) -> bool {
        match self.phase {
            Phase::Dropping => false,
            Phase::Idle => {
                self.fail(format!("{what} written outside an action"));
                false
            }
            Phase::Closed => {
                self.fail(format!("{what} written after the payload's object closed"));
                false
            }
            Phase::Payload => {
                if !object {
                    self.fail(format!("the payload is {what}, not a JSON object"));
                    return false;
                }
                true
            }
            Phase::Writing => match self.stack.last_mut() {
                Some(Frame::Array { first }) => {
                    if !*first {
                        self.out.push(b',');
                    }
                    *first = false;
                    true
                }
                Some(Frame::Object { expect_key, .. }) => {
                    if *expect_key {
                        self.fail(format!("{what} written in an object where a key belongs"));
                        return false;
                    }
                    *expect_key = true;
                    true
                }
                None => {
                    self.fail(format!("{what} written after the payload's object closed"));
                    false
                }
            },
        }
    }

    fn open(&mut self, frame: Frame, byte: u8, what: &str) {
        if !self.before(what, matches!(frame, Frame::Object { .. })) {
            return;
        }
        if self.stack.len() == MAX_DEPTH {
            return self.fail(format!("the payload nests deeper than {MAX_DEPTH} levels"));
        }
        self.out.push(byte);
        self.stack.push(frame);
        self.phase = Phase::Writing;
    }

    fn close(&mut self, object: bool) {
        if self.phase == Phase::Dropping {
            return;
        }
        let what = if object { "end_object" } else { "end_array" };
        match (self.stack.last(), object) {
            (
                Some(Frame::Object {
                    expect_key: true, ..
                }),
                true,
            ) => self.out.push(b'}'),
            (Some(Frame::Object { .. }), true) => {
                return self.fail("an object closed after a key without its value")
            }
            (Some(Frame::Array { .. }), false) => self.out.push(b']'),
            _ => return self.fail(format!("{what} does not match the open container")),
        }
        self.stack.pop();
        if self.stack.is_empty() {
            self.phase = Phase::Closed;
        }
    }

    pub fn begin_object(&mut self) {
        self.open(
            Frame::Object {
                first: true,
                expect_key: true,
            },
            b'{',
            "an object",
        );
    }

    pub fn end_object(&mut self) {
        self.close(true);
    }

    pub fn begin_array(&mut self) {
        self.open(Frame::Array { first: true }, b'[', "an array");
    }

    pub fn end_array(&mut self) {
        self.close(false);
    }

    pub fn key(&mut self, key: &str) {
        if self.phase == Phase::Dropping {
            return;
        }
        match self.stack.last_mut() {
            Some(Frame::Object { first, expect_key }) if *expect_key => {
                if !*first {
                    self.out.push(b',');
                }
                *first = false;
                *expect_key = false;
                write_string(&mut self.out, key);
                self.out.push(b':');
            }
            Some(Frame::Object { .. }) => self.fail(format!(
                "key {key:?} written where the previous key's value belongs"
            )),
            _ => self.fail(format!("key {key:?} written outside an object")),
        }
    }

    pub fn string(&mut self, value: &str) {
        if self.before_value("a string") {
            write_string(&mut self.out, value);
        }
    }

    pub fn u64(&mut self, value: u64) {
        if self.before_value("a number") {
            let mut digits = itoa::Buffer::new();
            self.out.extend_from_slice(digits.format(value).as_bytes());
        }
    }

    pub fn i64(&mut self, value: i64) {
        if self.before_value("a number") {
            let mut digits = itoa::Buffer::new();
            self.out.extend_from_slice(digits.format(value).as_bytes());
        }
    }

    pub fn f64(&mut self, value: f64) {
        if self.phase == Phase::Dropping {
            return;
        }
        if !value.is_finite() {
            return self.fail(format!("{value} is not a JSON number"));
        }
        if self.before_value("a number") {
            let mut digits = ryu::Buffer::new();
            self.out
                .extend_from_slice(digits.format_finite(value).as_bytes());
        }
    }

    pub fn bool(&mut self, value: bool) {
        if self.before_value("a boolean") {
            self.out
                .extend_from_slice(if value { b"true" } else { b"false" });
        }
    }

    pub fn null(&mut self) {
        if self.before_value("null") {
            self.out.extend_from_slice(b"null");
        }
    }

    pub fn u64_array(&mut self, values: &[u64]) {
        if !self.before_value("an array") {
            return;
        }
        // Digits are written in place, into room made once for the whole array
        // (at most 20 digits and a comma per value, and the last value's spare
        // word), then the room left over is cut off. Formatting each value into a
        // buffer and appending it would cost a `memcpy` call per value: most of the
        // time of a fetch of thousands of hashes (a profile of the hint-stage bench).
        // A signed engine's hashes: a value above `i64::MAX` is the negative number
        // with the same bits, at most 19 digits and a sign, so the room suffices.
        let signed =
            !values.is_empty() && self.signed.as_ref().is_some_and(|lent| lent.covers(values));
        let start = self.out.len();
        self.out
            .resize(start + values.len() * 21 + 2 + DECIMAL_ROOM, 0);
        let room = &mut self.out[start..];
        room[0] = b'[';
        let mut at = 1;
        // Two loops rather than a test per value: the unsigned one stays the loop
        // it was before signed hashes were known here (measured slower with the
        // test inside, on the booking bench's 12-digit hashes).
        if signed {
            for (i, &value) in values.iter().enumerate() {
                if i > 0 {
                    room[at] = b',';
                    at += 1;
                }
                if value > i64::MAX as u64 {
                    room[at] = b'-';
                    at += 1;
                }
                let magnitude = if value > i64::MAX as u64 {
                    value.wrapping_neg()
                } else {
                    value
                };
                at += write_decimal(&mut room[at..], magnitude);
            }
        } else {
            for (i, &value) in values.iter().enumerate() {
                if i > 0 {
                    room[at] = b',';
                    at += 1;
                }
                at += write_decimal(&mut room[at..], value);
            }
        }
        room[at] = b']';
        self.out.truncate(start + at + 1);
    }

    /// The policy's serializer gave up half-way.
    pub fn fail_payload(&mut self, message: &str) {
        self.fail(format!("the payload could not be written: {message}"));
    }
}

/// The room [`write_decimal`] may write into: 20 digits, and whole 8-byte words
/// that can run past the last digit.
const DECIMAL_ROOM: usize = 24;

/// 10^i for i in 0..20.
const POW10: [u64; 20] = {
    let mut table = [1u64; 20];
    let mut i = 1;
    while i < 20 {
        table[i] = table[i - 1] * 10;
        i += 1;
    }
    table
};

/// The two ASCII digits of each of 0..100 as the bytes of a little-endian u16. Room
/// for 128, so that an index masked to 7 bits needs no bounds check.
static DIGIT_PAIRS: [u16; 128] = {
    let mut table = [0u16; 128];
    let mut i = 0;
    while i < 100 {
        table[i] = u16::from_le_bytes([b'0' + (i / 10) as u8, b'0' + (i % 10) as u8]);
        i += 1;
    }
    table
};

/// How many decimal digits `value` has (1 for 0): a guess from its bit length,
/// corrected by one comparison.
#[inline(always)]
fn decimal_len(value: u64) -> usize {
    let bits = 64 - (value | 1).leading_zeros() as usize;
    // 1233 / 4096 is just above log10(2): the guess is the digit count or one less.
    let guess = (bits * 1233) >> 12;
    guess + usize::from((value | 1) >= POW10[guess])
}

#[inline(always)]
fn pair(digits: u64) -> u64 {
    u64::from(DIGIT_PAIRS[(digits & 127) as usize])
}

/// The eight digits of `x` (< 10^8, leading zeros kept), most significant first, as
/// the bytes of a little-endian word.
#[inline(always)]
fn eight_digits(x: u32) -> u64 {
    // x / 10^6 in fixed point with 48 fraction bits, the constant rounded up: the
    // integer part is the first two digits, and each next pair is the integer part of
    // the fraction times 100. Exact for every x < 10^8 (the tests check them all). No
    // division, and the four pairs are one multiply apart.
    const FRACTION: u64 = (1 << 48) - 1;
    let y = u64::from(x) * 281_474_977;
    let first = pair(y >> 48);
    let y = (y & FRACTION) * 100;
    let second = pair(y >> 48);
    let y = (y & FRACTION) * 100;
    let third = pair(y >> 48);
    let y = (y & FRACTION) * 100;
    first | second << 16 | third << 32 | pair(y >> 48) << 48
}

/// The four digits of `x` (< 10^4, leading zeros kept) in the low half of a word.
#[inline(always)]
fn four_digits(x: u32) -> u64 {
    let high = (x * 5243) >> 19; // x / 100 for every x < 10^4
    pair(u64::from(high)) | pair(u64::from(x - high * 100)) << 16
}

/// The `k` (1..=8) low digits of `x` (< 10^k), as the first `k` bytes of a word.
#[inline(always)]
fn leading_digits(x: u32, k: usize) -> u64 {
    if k <= 4 {
        four_digits(x) >> (8 * (4 - k))
    } else {
        eight_digits(x) >> (8 * (8 - k))
    }
}

/// Writes `value` in decimal at the start of `out`; returns how many digits it
/// wrote. `out` must have [`DECIMAL_ROOM`] bytes: digits go out as whole 8-byte
/// words, and the bytes after the last digit are left for the caller to overwrite.
/// (A profile of the booking bench had the previous four-digits-per-division loop at
/// a quarter of a booking; this takes about a third fewer instructions, by callgrind,
/// for 12-digit values and for the 19–20-digit hashes engines publish alike.)
fn write_decimal(out: &mut [u8], value: u64) -> usize {
    let len = decimal_len(value);
    // `u64_array` always makes the room; a shorter `out` would get nothing.
    debug_assert!(out.len() >= DECIMAL_ROOM, "no room for a decimal");
    let Some(out) = out.get_mut(..DECIMAL_ROOM) else {
        return 0;
    };
    let mut put = |at: usize, word: u64| out[at..at + 8].copy_from_slice(&word.to_le_bytes());
    if len <= 8 {
        put(0, leading_digits(value as u32, len));
    } else if len <= 16 {
        let high = value / 100_000_000;
        let low = (value - high * 100_000_000) as u32;
        let k = len - 8;
        put(0, leading_digits(high as u32, k));
        put(k, eight_digits(low));
    } else {
        let top = value / 10_000_000_000_000_000;
        let rest = value - top * 10_000_000_000_000_000;
        let middle = rest / 100_000_000;
        let low = (rest - middle * 100_000_000) as u32;
        let k = len - 16;
        put(0, leading_digits(top as u32, k));
        put(k, eight_digits(middle as u32));
        put(k + 8, eight_digits(low));
    }
    len
}

/// `text` as a JSON string, with serde_json's own escaping.
fn write_string(out: &mut Vec<u8>, text: &str) {
    // Writing a `&str` into a `Vec` cannot fail.
    let _ = serde_json::to_writer(&mut *out, text);
}

/// Runs one writer call from the plugin. The state pointer is always the
/// `MessageWriter` that [`MessageWriter::ffi`] handed out; a panic (there is
/// none to expect: this is the host's own code) is recorded, never unwound into
/// the plugin.
fn with(state: *mut ErasedObject, f: impl FnOnce(&mut MessageWriter)) {
    // SAFETY: `state` comes from `MessageWriter::ffi`, whose borrow of the
    // writer outlives the policy call that passes it back here.
    let writer = unsafe { &mut *state.cast::<MessageWriter>() };
    if catch_unwind(AssertUnwindSafe(|| f(&mut *writer))).is_err() {
        writer.fail("the router's writer failed");
    }
}

extern "C" fn begin_action(state: *mut ErasedObject, action_type: RStr<'_>, version: RStr<'_>) {
    with(state, |w| {
        w.begin_action(action_type.as_str(), version.as_str())
    })
}
extern "C" fn end_action(state: *mut ErasedObject) {
    with(state, MessageWriter::end_action)
}
extern "C" fn begin_object(state: *mut ErasedObject) {
    with(state, MessageWriter::begin_object)
}
extern "C" fn end_object(state: *mut ErasedObject) {
    with(state, MessageWriter::end_object)
}
extern "C" fn begin_array(state: *mut ErasedObject) {
    with(state, MessageWriter::begin_array)
}
extern "C" fn end_array(state: *mut ErasedObject) {
    with(state, MessageWriter::end_array)
}
extern "C" fn key(state: *mut ErasedObject, key: RStr<'_>) {
    with(state, |w| w.key(key.as_str()))
}
extern "C" fn string(state: *mut ErasedObject, value: RStr<'_>) {
    with(state, |w| w.string(value.as_str()))
}
extern "C" fn u64_value(state: *mut ErasedObject, value: u64) {
    with(state, |w| w.u64(value))
}
extern "C" fn i64_value(state: *mut ErasedObject, value: i64) {
    with(state, |w| w.i64(value))
}
extern "C" fn f64_value(state: *mut ErasedObject, value: f64) {
    with(state, |w| w.f64(value))
}
extern "C" fn bool_value(state: *mut ErasedObject, value: bool) {
    with(state, |w| w.bool(value))
}
extern "C" fn null(state: *mut ErasedObject) {
    with(state, MessageWriter::null)
}
extern "C" fn u64_array(state: *mut ErasedObject, values: RSlice<'_, u64>) {
    with(state, |w| w.u64_array(values.as_slice()))
}
extern "C" fn fail(state: *mut ErasedObject, message: RStr<'_>) {
    with(state, |w| w.fail_payload(message.as_str()))
}

static VTABLE: FfiWriterVtable = FfiWriterVtable {
    begin_action,
    end_action,
    begin_object,
    end_object,
    begin_array,
    end_array,
    key,
    string,
    u64: u64_value,
    i64: i64_value,
    f64: f64_value,
    bool: bool_value,
    null,
    u64_array,
    fail,
};

#[cfg(test)]
mod tests {
    use super::*;

    fn message(w: &mut MessageWriter) -> serde_json::Value {
        serde_json::from_str(w.finish().expect("a message")).expect("valid JSON")
    }

    #[test]
    fn writes_the_envelope_with_numbered_actions() {
        let mut w = MessageWriter::default();
        w.begin_message("req\"1", 32);
        w.begin_policy();
        w.begin_action("kv.fetch", "1.0");
        w.begin_object();
        w.key("source_control_endpoint");
        w.string("tcp://10.0.0.7:23280");
        w.key("block_hashes");
        w.u64_array(&[11, 22]);
        w.key("nested");
        w.begin_array();
        w.i64(-1);
        w.f64(0.5);
        w.bool(true);
        w.null();
        w.begin_object();
        w.end_object();
        w.end_array();
        w.end_object();
        w.end_action();
        w.begin_action("x.y", "2");
        w.begin_object();
        w.end_object();
        w.end_action();
        assert_eq!(w.end_policy(true), PolicyOutput::Kept(2));
        assert_eq!(w.action_types().collect::<Vec<_>>(), ["kv.fetch", "x.y"]);
        assert_eq!(
            message(&mut w),
            serde_json::json!({"protocol_version": "0.1", "message_id": "req\"1", "actions": [
                {"action_id": "a1", "action_type": "kv.fetch", "action_version": "1.0",
                 "payload": {"source_control_endpoint": "tcp://10.0.0.7:23280", "block_hashes": [11, 22],
                             "nested": [-1, 0.5, true, null, {}]}},
                {"action_id": "a2", "action_type": "x.y", "action_version": "2", "payload": {}}]})
        );
    }

    /// Runs `f` as one policy after a good one; returns what the bad one got.
    fn after_a_good_policy(f: impl FnOnce(&mut MessageWriter)) -> PolicyOutput {
        let mut w = MessageWriter::default();
        w.begin_message("r", 32);
        w.begin_policy();
        w.begin_action("good", "1");
        w.begin_object();
        w.end_object();
        w.end_action();
        assert_eq!(w.end_policy(true), PolicyOutput::Kept(1));
        w.begin_policy();
        f(&mut w);
        let output = w.end_policy(true);
        assert_eq!(w.actions(), 1, "the good policy's action survives");
        assert_eq!(message(&mut w)["actions"].as_array().map(Vec::len), Some(1));
        output
    }

    #[test]
    fn every_grammar_break_discards_only_that_policy() {
        type Case = Box<dyn Fn(&mut MessageWriter)>;
        let cases: Vec<(&str, Case)> = vec![
            (
                "not a JSON object",
                Box::new(|w| {
                    w.begin_action("a", "1");
                    w.u64_array(&[1]);
                    w.end_action();
                }),
            ),
            (
                "where a key belongs",
                Box::new(|w| {
                    w.begin_action("a", "1");
                    w.begin_object();
                    w.u64(1);
                }),
            ),
            (
                "previous key's value",
                Box::new(|w| {
                    w.begin_action("a", "1");
                    w.begin_object();
                    w.key("a");
                    w.key("b");
                }),
            ),
            (
                "without its value",
                Box::new(|w| {
                    w.begin_action("a", "1");
                    w.begin_object();
                    w.key("a");
                    w.end_object();
                }),
            ),
            (
                "container is open",
                Box::new(|w| {
                    w.begin_action("a", "1");
                    w.begin_object();
                    w.end_action();
                }),
            ),
            ("outside an action", Box::new(|w| w.string("loose"))),
            ("still open", Box::new(|w| w.begin_action("a", "1"))),
            ("empty action_type", Box::new(|w| w.begin_action("", "1"))),
            (
                "not a JSON number",
                Box::new(|w| {
                    w.begin_action("a", "1");
                    w.begin_object();
                    w.key("x");
                    w.f64(f64::NAN);
                }),
            ),
            (
                "after the payload's object closed",
                Box::new(|w| {
                    w.begin_action("a", "1");
                    w.begin_object();
                    w.end_object();
                    w.null();
                }),
            ),
            (
                "does not match",
                Box::new(|w| {
                    w.begin_action("a", "1");
                    w.begin_object();
                    w.key("k");
                    w.begin_array();
                    w.end_object();
                }),
            ),
        ];
        for (expected, case) in cases {
            match after_a_good_policy(|w| case(w)) {
                PolicyOutput::Malformed(message) => {
                    assert!(
                        message.contains(expected),
                        "{expected:?} not in {message:?}"
                    )
                }
                other => panic!("{expected}: {other:?}"),
            }
        }
    }

    #[test]
    fn a_failed_policy_is_rolled_back() {
        assert_eq!(
            after_a_good_policy(|w| {
                w.begin_action("b", "1");
                w.begin_object();
                w.end_object();
                w.end_action();
                // The policy then returns an error.
                let _ = w.end_policy(false);
                w.begin_policy();
            }),
            PolicyOutput::Kept(0)
        );
    }

    #[test]
    fn actions_past_the_cap_are_dropped_whole() {
        let mut w = MessageWriter::default();
        w.begin_message("r", 2);
        w.begin_policy();
        for _ in 0..3 {
            w.begin_action("a", "1");
            w.begin_object();
            w.key("k");
            w.u64(1);
            w.end_object();
            w.end_action();
        }
        assert_eq!(w.end_policy(true), PolicyOutput::Kept(2));
        assert_eq!(w.dropped(), 1);
        assert_eq!(message(&mut w)["actions"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn what_is_dropped_over_the_cap_is_not_checked() {
        let mut w = MessageWriter::default();
        w.begin_message("r", 1);
        w.begin_policy();
        for value in [1.0, f64::NAN] {
            w.begin_action("a", "1");
            w.begin_object();
            w.key("k");
            w.f64(value);
            w.end_object();
            w.end_action();
        }
        assert_eq!(w.end_policy(true), PolicyOutput::Kept(1));
        assert_eq!(w.dropped(), 1);
    }

    #[test]
    fn numbers_are_written_as_decimal_exactly() {
        let values = [
            0,
            9,
            10,
            99,
            100,
            101,
            999_999,
            1 << 40,
            u64::MAX / 7,
            u64::MAX - 1,
            u64::MAX,
        ];
        let mut w = MessageWriter::default();
        w.begin_message("r", 32);
        w.begin_policy();
        w.begin_action("a", "1");
        w.begin_object();
        w.key("n");
        w.u64_array(&values);
        w.key("empty");
        w.u64_array(&[]);
        w.end_object();
        w.end_action();
        assert_eq!(w.end_policy(true), PolicyOutput::Kept(1));
        let message = message(&mut w);
        let written: Vec<u64> = message["actions"][0]["payload"]["n"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .collect();
        assert_eq!(written, values);
        assert_eq!(
            message["actions"][0]["payload"]["empty"],
            serde_json::json!([])
        );
        // Every width, against the standard library's formatting.
        let mut room = [0u8; DECIMAL_ROOM];
        // (Fewer under Miri, which interprets each one; every width is still hit.)
        let samples = if cfg!(miri) { 640 } else { 20_000u64 };
        for i in 0..samples {
            let value = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (i % 64);
            let len = write_decimal(&mut room, value);
            assert_eq!(&room[..len], value.to_string().as_bytes());
        }
        // Each power of ten and its neighbours, where the digit count changes.
        let mut edges = vec![0, u64::MAX, u64::MAX - 1];
        for power in POW10 {
            edges.extend([power - 1, power, power + 1]);
        }
        for value in edges {
            let len = write_decimal(&mut room, value);
            assert_eq!(&room[..len], value.to_string().as_bytes());
        }
    }

    /// The fixed-point digit extraction is exact for every one of the 10^8 inputs it
    /// can be given, not just the sampled ones.
    #[test]
    #[cfg_attr(
        miri,
        ignore = "10^8 inputs take hours under Miri; the digit arithmetic has no unsafe"
    )]
    fn eight_digits_are_exact_for_every_input() {
        // The expected digits, counted up in ASCII alongside (cheap enough for a debug
        // build to go through all 10^8).
        let mut expected = *b"00000000";
        for x in 0..100_000_000u32 {
            if eight_digits(x).to_le_bytes() != expected {
                panic!(
                    "eight_digits({x}) wrote {:?}",
                    eight_digits(x).to_le_bytes()
                );
            }
            for digit in expected.iter_mut().rev() {
                if *digit == b'9' {
                    *digit = b'0';
                } else {
                    *digit += 1;
                    break;
                }
            }
        }
    }

    #[test]
    fn lent_signed_hashes_go_out_signed() {
        let lent: Vec<u64> = vec![u64::MAX - 4, 7, 1 << 63];
        let own = lent.clone();
        let signed = Rc::new(SignedHashes::default());
        signed.lend(&lent);
        let mut w = MessageWriter::default();
        w.set_signed_hashes(Some(Rc::clone(&signed)));
        w.begin_message("r", 32);
        w.begin_policy();
        for hashes in [&lent[..], &lent[1..], &own[..]] {
            w.begin_action("kv.fetch", "1.0");
            w.begin_object();
            w.key("block_hashes");
            w.u64_array(hashes);
            w.end_object();
            w.end_action();
        }
        assert_eq!(w.end_policy(true), PolicyOutput::Kept(3));
        let m = message(&mut w);
        assert_eq!(
            m["actions"][0]["payload"]["block_hashes"],
            serde_json::json!([-5, 7, i64::MIN]),
            "the lent slice, as its engine published it"
        );
        assert_eq!(
            m["actions"][1]["payload"]["block_hashes"],
            serde_json::json!([7, i64::MIN]),
            "part of it, likewise"
        );
        assert_eq!(
            m["actions"][2]["payload"]["block_hashes"],
            serde_json::json!([u64::MAX - 4, 7, 1u64 << 63]),
            "the policy's own copy is its own: unsigned"
        );
        signed.clear();
        assert!(!signed.covers(&lent));
    }

    #[test]
    fn no_action_is_no_message() {
        let mut w = MessageWriter::default();
        w.begin_message("r", 32);
        w.begin_policy();
        assert_eq!(w.end_policy(true), PolicyOutput::Kept(0));
        assert!(w.finish().is_none());
    }

    #[test]
    fn nesting_is_bounded() {
        let output = after_a_good_policy(|w| {
            w.begin_action("a", "1");
            for _ in 0..=MAX_DEPTH {
                w.begin_array();
            }
        });
        // The first begin is an array: refused as a payload.
        assert!(matches!(output, PolicyOutput::Malformed(_)));
        let output = after_a_good_policy(|w| {
            w.begin_action("a", "1");
            w.begin_object();
            w.key("k");
            for _ in 0..MAX_DEPTH {
                w.begin_array();
            }
        });
        match output {
            PolicyOutput::Malformed(message) => assert!(message.contains("deeper"), "{message}"),
            other => panic!("{other:?}"),
        }
    }
}
